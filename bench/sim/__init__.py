"""A vLLM-faithful cluster simulator for comparing routing policies (``python -m bench.sim``).

One concept per module: ``pool`` (vLLM's block pool and its KV events), ``costs`` (the
time model), ``pod`` (a pod's scheduler), ``cluster`` (pods and their ZMQ publishers),
``workloads`` (seeded traffic), ``policies`` (routers), ``service`` (the real kvindex
subprocess and its HTTP client), ``runner`` (one discrete-event run), ``agreement``
(index vs pods), ``results``, ``claims``, ``scenarios``, ``report``, ``progress``.
"""
