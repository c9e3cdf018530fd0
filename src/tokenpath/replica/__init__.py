"""How a request reaches an engine: one `Replica` interface (`base`), the in-process engine
(`local`), a remote OpenAI-compatible server (`remote`), local engine processes over the engine
link (`processes`, `link_client`, `link_server`), Ray actors (`ray_replica`, `ray_actor`), and the
gateway's view of a deployment's replicas: in-flight counts, room and ejection (`pool`). The
timer-driven simulated replica that tests and the gateway benchmark use lives in
`tests/simulated_replica.py`."""
