"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): a shape at the edge.

A Messages body is translated into the internal chat completion request (`translate`) and runs
the very same pipeline (`generation.handle`: key, model ACL, quotas, admission, audit, Timeline,
metrics); only the finished body, the stream (`stream`) and error bodies (`errors`) are reshaped.
"""
