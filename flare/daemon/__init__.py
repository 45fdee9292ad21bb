"""The daemon process: `flare run`'s life from start to exit, its config, the control socket,
systemd notification and logging."""
