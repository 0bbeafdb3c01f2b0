"""`kvtierd bench ...`: benchmarks that print tables and write their figures as JSON."""
