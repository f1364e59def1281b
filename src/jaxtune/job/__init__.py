"""What a run keeps and how its processes meet, whatever it trains: the run directory (`run_dir`), Orbax
checkpoints (`checkpoint`), `jax.distributed` start-up and cross-host errors (`distributed`), the profiler
(`profile`). It knows nothing of models, data or objectives: below `jaxtune.train`."""
