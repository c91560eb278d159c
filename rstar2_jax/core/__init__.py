"""What every layer of rstar2_jax shares: the registries and typed config sections (registry.py,
config_types.py, part_sections.py), devices and processes (sharding.py,
processes.py, shared_jit.py), seeds, timelines and the run's checkpoints."""
