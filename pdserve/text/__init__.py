"""Text handling shared by the router and the engine: prompt tokenization, chat templates, incremental
detokenization. No torch."""
