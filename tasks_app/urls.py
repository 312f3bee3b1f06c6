"""Routes of the task pages, the dashboard and the JSON API (included at the site root)."""

from django.urls import path

from tasks_app.web import api, browser, dashboard, tasks, workflows

app_name = "tasks_app"

urlpatterns = [
    path("tasks/", browser.task_browser, name="browser"),
    path("tasks/enqueue/", tasks.enqueue_task, name="enqueue"),
    path("tasks/dashboard/", dashboard.queue_dashboard, name="dashboard"),
    path("tasks/dashboard/series.json", dashboard.chart_series, name="dashboard-series"),
    path("tasks/dashboard/<str:queue>/dead/", dashboard.dead_letter_page, name="dead-letters"),
    path("tasks/dashboard/<str:queue>/pause/", dashboard.pause_page, name="queue-pause"),
    path("tasks/workflows/<str:workflow_id>/", workflows.workflow_detail, name="workflow"),
    path("tasks/workflows/<str:workflow_id>/cancel/", workflows.cancel_workflow, name="workflow-cancel"),
    path("tasks/<str:task_id>/", tasks.task_detail, name="task"),
    path("api/tasks/", api.create_task, name="api-tasks"),
    path("api/tasks/<str:task_id>/", api.task_record, name="api-task"),
    path("api/tasks/<str:task_id>/cancel/", api.cancel_task, name="api-task-cancel"),
    path("tasks/<str:task_id>/cancel/", tasks.cancel_task, name="task-cancel"),
    path("api/workflows/<str:workflow_id>/", api.workflow_state, name="api-workflow"),
    path("api/workflows/<str:workflow_id>/cancel/", api.cancel_workflow, name="api-workflow-cancel"),
    path("api/queues/<str:queue>/", api.api_queue, name="api-queue"),
    path("api/queues/<str:queue>/pause/", api.api_pause, {"paused": True}, name="api-queue-pause"),
    path("api/queues/<str:queue>/resume/", api.api_pause, {"paused": False}, name="api-queue-resume"),
]
