"""The lab beside the package: suites run by one runner (`python -m benchmarks.run SUITE`), their records and index.

docs/benchmarks.md says how to run a suite and how to read a record; benchmarks/results/README.md lists every record.
"""
