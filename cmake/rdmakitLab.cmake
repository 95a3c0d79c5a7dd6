# rdmakit_add_rxe_test(NAME name [VMS n] [TIMEOUT sec] COMMAND cmd args...)
#
# Registers a CTest test, labelled `rxe`, that boots n lab VMs (lab/rdmakit-lab) and runs the
# command in each of them (it reads RDMAKIT_LAB_INDEX to pick its role). The command's timeout is
# enforced inside the lab; CTest's own TIMEOUT is a backstop that adds room for booting.
# rxe tests run one at a time: each VM takes host cores, and timing checks must not share them.
set(RDMAKIT_LAB ${CMAKE_CURRENT_LIST_DIR}/../lab/rdmakit-lab)

function(rdmakit_add_rxe_test)
  cmake_parse_arguments(ARG "" "NAME;VMS;TIMEOUT" "COMMAND" ${ARGN})
  if(NOT ARG_VMS)
    set(ARG_VMS 1)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  math(EXPR backstop "${ARG_TIMEOUT} + 240")
  add_test(NAME rxe.${ARG_NAME}
           # The guest's stdout is a terminal (virtio console): keep GoogleTest's output plain.
           # The source and build trees may live below /tmp, which the guest replaces with its own.
           COMMAND env GTEST_COLOR=no ${RDMAKIT_LAB} run --vms ${ARG_VMS} --timeout ${ARG_TIMEOUT}
                   --share ${PROJECT_SOURCE_DIR} --share ${PROJECT_BINARY_DIR} -- ${ARG_COMMAND}
           WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  set_tests_properties(rxe.${ARG_NAME} PROPERTIES
    LABELS rxe TIMEOUT ${backstop} RUN_SERIAL TRUE)
endfunction()
