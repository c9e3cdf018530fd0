"""How a request reaches an engine: one `Replica` interface (`base`), the in-process engine
(`local`), a remote OpenAI-compatible server (`remote`), local engine processes (`processes`),
a timer-driven simulated replica for tests (`simulated`), and the gateway's view of a
deployment's replicas: in-flight counts, room and ejection (`pool`)."""
