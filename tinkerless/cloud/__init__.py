"""Cloud backends: the same run on Modal (serverless GPUs) or SkyPilot (any cloud, on-prem).

Both import their SDK lazily, so `import tinkerless` never needs modal or skypilot.
"""
