"""Command lines: serve (the servers), generate (one prompt), convert (Orbax), client (gRPC)."""
