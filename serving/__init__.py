"""Serving: the gRPC service `jaxpaged.v1.Generation`, the OpenAI-compatible HTTP API, their
shared admission/drain logic, Prometheus metrics, and Python clients.

Modules: `server` (both front ends on one loop, life cycle), `grpc_service`, `http_app`,
`protocol` (OpenAI bodies -> SamplingParams), `frontend` (admission, in-flight, drain),
`deltas` (merges several requests' streams), `chat_run` (one chat request, shared by
`responses` (OpenAI's Responses API; `responses_protocol`, `response_store`) and `anthropic`
(Anthropic's Messages API; `anthropic_protocol`)), `batch` (OpenAI batch files run in
process), `metrics` (also under vLLM's names, for routers), `ray_serve` (Ray Serve
replicas: `build_app`; needs the ray extra), `client` (gRPC clients; imports
neither JAX nor the engine), and the generated `generation_pb2` / `generation_pb2_grpc`
(regenerate: serving/regen_proto.sh). Nothing is imported here, so `jaxpaged.serving.client`
stays light.
"""
