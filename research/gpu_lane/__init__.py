"""The GPU lane: ``pack.py`` packs what a bare CUDA machine lacks into parts a device call can carry,
``lane.py`` installs them there and measures the project on the GPU, in one table (docs/gpu.md).
Both run as files (``python research/gpu_lane/lane.py``) as well as modules."""
