"""What the benchmark tables are made of: the results files, statistics of paired ratios, the
table, and the freshness of each result against the code it measured. Stdlib only."""
