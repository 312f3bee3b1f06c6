"""The Redis protocol of docs/PROTOCOL.md: keys, scripts, the broker, the task envelope, result records."""
