"""The training job being planned: model shape, parallel layout, and the ops of one layer.

- models.toml, models.py: transformer model shapes (presets, or a small YAML/JSON file).
- parallel.py: the parallel layout (sizes, layers per pipeline stage) and its validation.
- opgraph.py: the kernels one GPU runs for one nanobatch of one transformer layer.
"""
