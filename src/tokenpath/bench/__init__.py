"""`tokenpath bench`: a load generator for any OpenAI-compatible endpoint, with vllm-compatible
metrics (TTFT, TPOT, ITL, E2EL, goodput), server-side stage breakdowns and side-by-side reports.

Modules: `records` (data), `metrics` (arithmetic), `tokens` + `workload` (seeded prompts),
`client` (streaming HTTP + SSE timing), `runner` (arrivals, warm-up, bounds), `report` + `plots`.
"""
