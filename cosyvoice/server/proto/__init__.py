"""The gRPC wire format: ``cosyvoice.proto`` and the stubs grpcio-tools generates from it (never edited by hand)."""
