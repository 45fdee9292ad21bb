"""The `flare` command line: run, export, inspect, ctl, bench."""
