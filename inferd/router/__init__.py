"""Multi-replica routing: `inferd router` and `inferd serve --data-parallel-size N`.

Pure policy first (index.py, load.py, adapters.py, policy.py, cluster.py: no I/O, injectable RNG
and clock), then the process around it (tokenize.py, health.py, proxy.py, app.py, metrics.py,
launch.py).
docs/scale-out.md describes the flags, policies and metrics.
"""
