"""Gradient analytics computed from the store after the fact (docs/design/017).

Norms, spikes, the first non-finite value, peer agreement, the gradient noise
scale, histograms, influence projections and diffs: each a Dask graph over
stored chunks (or over the manifests' chunk statistics alone, where they
suffice), each memoised in the store under ``analytics/<run>``.
"""
