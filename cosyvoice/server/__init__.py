"""Network adapters over :class:`cosyvoice.service.TTSService`: REST (``rest``), gRPC, Ray Serve, metrics."""
