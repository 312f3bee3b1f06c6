"""Example handlers for trying the queue locally; `make run` enables them through TASK_HANDLER_MODULES."""
