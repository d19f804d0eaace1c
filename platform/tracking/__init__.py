"""The tracking layer: the only code that talks to MLflow (runs, dataset inputs, descriptions, saved
views) and the metric and tag names every other module uses."""
