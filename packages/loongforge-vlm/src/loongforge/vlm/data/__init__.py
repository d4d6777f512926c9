"""VLM data: conversation records with images/videos, media processing, the cached index, packing, the shipped demo set."""
