"""Ray fleet of single-GPU megatrain trainers: hyper-parameter sweeps launched with `ray job submit`."""
