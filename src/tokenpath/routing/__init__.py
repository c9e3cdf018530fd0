"""Where does a request go? Model routing (`models`: name/alias -> deployment, fallbacks, tasks),
replica picking (`replicas`: round_robin, least_loaded, prefix_aware, session_affinity) and
deployments from configuration (`config`: local engine processes or URLs, `serve --replicas N`).

The decisions are recorded on each request's Timeline (`routed`, `admitted`, `dequeued`,
`dispatched` with deployment, replica, policy and reason) and counted in
`tokenpath.telemetry.series`.
"""
