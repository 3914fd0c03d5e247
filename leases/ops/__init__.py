"""What operators see: the dashboard, the Prometheus metrics, and what every app's admin
shares (masking of secrets, the per-database sites, the database clock per request).

The base app's own modules; the companion apps add their panels and metric families
through `readings` when they are ready.
"""
