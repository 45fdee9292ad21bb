"""`flare bench`: a serving benchmark for flare or any OpenAI-compatible server.

A client only: it speaks HTTP to `/v1/chat/completions` (and reads `/metrics` when the server
is flare) and never imports the scheduler or the engine, so it measures what users see.

- `datasets.py`: the shipped prompt sets and JSONL files, as conversations to send
- `client.py`: one streaming request, timed chunk by chunk, and what became of it
- `load.py`: fixed concurrency levels or Poisson arrivals, warm-up, count and time bounds
- `stats.py`: percentiles and the per-level summary
- `server_metrics.py`: flare's `/metrics` before and after a level
- `progress.py`: the live progress line on a terminal
- `report.py`: the result JSON (machine, versions, settings) and the closing table
- `plot.py`: PNG figures of one or several results (matplotlib, optional)
- `cli.py`: the `flare bench` and `flare bench plot` commands
"""
