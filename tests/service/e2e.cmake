# Every test_*.py here: the real server binary, driven by a Python grpcio client
# (Debian's), one ctest each (service_e2e_<name>, label "e2e"), so that
# `ctest -j` runs them beside each other. test_hf_server_parity.py and
# test_gguf_server_parity.py need torch and transformers: the venv.
# Under ThreadSanitizer (tools/tsan.sh) the server runs several times slower:
# the whole folder takes about 16 minutes of one core on 2 cores; no file
# takes more than a few, and each gets 20.
set(_e2e_timeout 600)
if(CMAKE_CXX_FLAGS MATCHES "-fsanitize=thread")
  set(_e2e_timeout 1200)
endif()
file(GLOB _e2e_files CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/test_*.py)
list(FILTER _e2e_files EXCLUDE REGEX "/test_(hf|gguf)_server_parity\\.py$")
foreach(_file IN LISTS _e2e_files)
  get_filename_component(_name ${_file} NAME_WE)
  string(REGEX REPLACE "^test_(.*)_e2e$" "\\1" _name ${_name})
  string(REGEX REPLACE "^test_" "" _name ${_name})
  # Its own --basetemp: pytest runs side by side share no temporary folder.
  add_test(NAME service_e2e_${_name}
           COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider
                   --basetemp=${CMAKE_CURRENT_BINARY_DIR}/pytest-${_name} ${_file})
  set_tests_properties(service_e2e_${_name} PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
    ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
    TIMEOUT ${_e2e_timeout} LABELS "e2e;tsan"
    COST 100)  # started before the short unit tests
endforeach()

add_test(NAME hf_server_parity
         COMMAND ${COALESCE_PYTHON} -m pytest -q -p no:cacheprovider
                 ${CMAKE_CURRENT_SOURCE_DIR}/test_hf_server_parity.py)
set_tests_properties(hf_server_parity PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
  TIMEOUT 600)

# SmolLM2-135M-Instruct from its GGUF through the server against transformers
# loading the same file; fetches the model once into COALESCE_MODEL_CACHE.
add_test(NAME gguf_server_parity
         COMMAND ${COALESCE_PYTHON} -m pytest -q -p no:cacheprovider
                 ${CMAKE_CURRENT_SOURCE_DIR}/test_gguf_server_parity.py)
set_tests_properties(gguf_server_parity PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR};COALESCE_GGUF_CACHE=${COALESCE_MODEL_CACHE}"
  TIMEOUT 900)
