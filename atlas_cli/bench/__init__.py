"""`atlas bench`: llama-bench-style throughput runs, MLPerf-style agentic replay, the regression
and coherence gates. Importing this package stays light (no numpy): the CLI loads it eagerly."""
