"""kvrc coordinator service: domain core (pure) and its gRPC/ZMQ/metrics edges."""
