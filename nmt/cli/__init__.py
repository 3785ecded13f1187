"""Console entry points: nmt-train, nmt-translate, nmt-data, nmt-eval."""
