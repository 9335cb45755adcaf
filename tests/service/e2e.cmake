# Every test_*.py here: the real server binary, driven by a Python grpcio client.
add_test(NAME service_e2e
         COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_SOURCE_DIR})
set_tests_properties(service_e2e PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
  TIMEOUT 600)
