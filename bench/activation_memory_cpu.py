"""Peak memory of one LLM training step on the CPU, measured, at sequence lengths 2K..32K, with and
without ChunkPipe (``train.seq_chunks``) and activation offloading (``train.offload_layers``).

    uv run python bench/activation_memory_cpu.py                       # the README's table
    uv run python bench/activation_memory_cpu.py --seqs 2048,4096 --chunk 1024

Each case runs in a fresh process (``--case``): ``lf-llm``'s trainer on the CPU accelerator (fp32)
with a small Llama (``--layers`` x ``--hidden``, 4 heads, 2 KV groups, vocabulary 8192), one
sequence per step. Around the first step's forward and backward the process's resident-set
high-water mark is reset (``/proc/self/clear_refs``) and read back (``VmHWM``): the table's
"step peak" is that high-water mark minus the resident set just before, i.e. what the step
allocated on top of the weights, gradients and data, activations above all. glibc is told to
serve every allocation above 64 KiB with its own mapping (``MALLOC_MMAP_THRESHOLD_``, in the
child's environment), so freed tensors leave the resident set and the mark follows the live
tensors.

Offloading moves saved activations from the accelerator to host memory; on the CPU both are the
same memory, so the resident set cannot drop. Its row reports what the offloader moved in the step
(``offloaded``, counted by the offloader as it copies) and ``step peak - offloaded``, which is what
would stay on an accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_case(seq: int, chunks: int, offload: int, layers: int, hidden: int) -> dict:
    """One training step in this process; its measured peak (see the module docstring)."""
    from loongforge.core.config import to_dict
    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import load_llm_config, make_task

    with tempfile.TemporaryDirectory(prefix="lf-actmem-") as scratch:
        cfg = load_llm_config("train_debug", [
            f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.ffn_hidden_size={hidden * 11 // 4}",
            "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=8192",
            f"model.max_position_embeddings={seq}", f"train.seq_length={seq}", "train.global_batch_size=1",
            "train.micro_batch_size=1", "train.steps=1", f"train.seq_chunks={chunks}", f"train.offload_layers={offload}",
            "log.progress=false", "log.tensorboard=false", "checkpoint.save=false", f"log.run_dir={scratch}/run",
            f"data.cache_dir={scratch}/data",
        ])
        task = make_task(cfg)
        ctx = init_parallel(seed=cfg.train.seed)
        trainer = Trainer(task, ctx, cfg, config_record=to_dict(cfg))
        engine = trainer.engine
        forward_backward = engine.forward_backward
        measured = {}

        def measured_step(step, measuring=False):
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
            before = _rss_kib("VmRSS")
            out = forward_backward(step, measuring)
            measured.update(peak_mib=(_rss_kib("VmHWM") - before) / 1024, loss=out.loss,
                            offloaded_mib=(out.offloaded_bytes or 0) / 2**20)
            return out

        engine.forward_backward = measured_step
        trainer.fit()
        destroy_parallel()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="2048,4096,8192,16384,32768")
    parser.add_argument("--chunk", type=int, default=1024, help="ChunkPipe's chunk length (seq_chunks = seq / chunk)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # SEQ,CHUNKS,OFFLOAD: run one case, print JSON
    args = parser.parse_args()
    if args.case:
        seq, chunks, offload = (int(v) for v in args.case.split(","))
        print(json.dumps(run_case(seq, chunks, offload, args.layers, args.hidden)))
        return

    env = {**os.environ, "LOONGFORGE_ACCELERATOR": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"# one training step, fp32 on the CPU: Llama {args.layers} layers x hidden {args.hidden} (4 heads, "
          f"2 KV groups, vocabulary 8192), one sequence; ChunkPipe chunks of {args.chunk} tokens; offload: every layer")
    print("| seq | none: step peak MiB | ChunkPipe: step peak MiB | offload: step peak MiB | offload: moved MiB | "
          "offload: peak - moved MiB | loss (none / ChunkPipe / offload) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for seq in (int(s) for s in args.seqs.split(",")):
        rows = {}
        for name, chunks, offload in (("none", 1, 0), ("chunks", max(1, seq // args.chunk), 0),
                                      ("offload", 1, args.layers)):
            proc = subprocess.run([sys.executable, __file__, "--case", f"{seq},{chunks},{offload}",
                                   "--layers", str(args.layers), "--hidden", str(args.hidden)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"error: case seq={seq} chunks={chunks} offload={offload} failed:\n{proc.stderr[-3000:]}")
            rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        n, c, o = rows["none"], rows["chunks"], rows["offload"]
        print(f"| {seq} | {n['peak_mib']:.0f} | {c['peak_mib']:.0f} | {o['peak_mib']:.0f} | {o['offloaded_mib']:.0f} | "
              f"{o['peak_mib'] - o['offloaded_mib']:.0f} | {n['loss']:.4f} / {c['loss']:.4f} / {o['loss']:.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
