"""Config-driven benchmarks: `runner` (sweeps, resume, results), the tasks `perplexity`, `niah`,
`throughput`, `budget` (KV calculator), `plots`, `shapes` (known model shapes)."""
