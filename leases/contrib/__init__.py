"""Integrations of django-leases with other frameworks; each needs its optional extra."""
