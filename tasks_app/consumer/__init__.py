"""What runs inside `manage.py runconsumer`: lifecycle, claiming, running, acking, background loops."""
