"""LeRobot datasets as policy batches: chunking, normalisation, cameras, language tokens."""
