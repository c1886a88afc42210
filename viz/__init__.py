"""Pure functions from engine snapshots to plotly figures (built with the playground issue)."""
