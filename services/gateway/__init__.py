"""The gateway: OpenAI HTTP/SSE and gRPC `kvmesh.v1.Inference` in front of the
scheduler (admission, placement) and the engines (tokens). Entry points:
`services.gateway.server.GatewayService` and `services.gateway.server.serve`."""
