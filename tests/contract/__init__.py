"""Contract suites: every scenario once, on each backend the scheme registry names."""
