"""Web views: the staff enqueue form and task pages, the JSON API, the queue dashboard."""
