"""An out-of-tree LoongForge plugin, as a downstream team would write one: a VLM vision encoder
(``plain_vit``) and a robot policy (``mlp_policy``), each one module registered through an entry
point (``lf_plugin_example-0.1.dist-info/entry_points.txt``), each trained by the stock CLI from a
YAML (``configs/``). ``docs/add-a-model.md`` walks through them."""
