"""Django's tasks framework on this queue: the backend a project configures and the runner of `@task` functions."""
