"""Small runnable examples of django-leases: ``python -m project.examples.<name>``."""
