"""Training: the loop (`loop`), the run folder's life (`runs`), resuming (`resume`), what this machine is
fast at (`machine`), optimisers and schedules (`optim`), batch warm-ups (`curriculum`), named presets
(`presets`), torchrun process groups (`distributed`), and where a run's numbers go (`logs`, `sinks`)."""
