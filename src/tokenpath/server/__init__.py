"""Start-up wiring, the top layer: the `serve` and `engine` commands (`cli`, `engine_process`), the
one serve config (`config`), and the deployment builders (`deployments`: in-process engines;
`routing_config`: engine processes, URLs and routing files). Nothing below imports it."""
