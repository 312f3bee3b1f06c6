"""`tasks_app.broker.get_broker`, the path the README gives for reading results: the broker lives in protocol."""

from tasks_app.protocol.broker import Broker, get_broker

__all__ = ["Broker", "get_broker"]
