"""Data sets, prompt building and answer metrics for the main job and the benchmarks."""
