"""OpenAI's Responses API (`POST /v1/responses`) as a shape at the edge over the chat pipeline:
`schemas` (the request), `translate` (items <-> chat messages, reply -> response object),
`stream` (the typed SSE events), `handler` (routes and stored responses)."""
