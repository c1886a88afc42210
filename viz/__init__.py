"""Pure functions from engine snapshots and measurements to plotly figures."""
