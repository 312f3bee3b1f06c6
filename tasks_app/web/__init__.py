"""The web app's side: staff pages (enqueue form, task pages, dashboard), the JSON API and its tokens, `/healthz`."""
