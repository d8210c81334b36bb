"""Every backend's shared contract, one scenario per test, parametrised by the scheme registry."""
