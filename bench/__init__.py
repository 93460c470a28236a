"""`ferry bench`: reproducible benchmarks of Ferry against static batching and transformers' continuous batching.

offline: one workload through three systems, token-equality check, model floor and efficiency, timeline plot.
serve: streaming load against an OpenAI-compatible server (closed-loop sweep, open-loop Poisson rates).
overhead: CPU microseconds per engine step with a zero-cost model.
"""
